"""kvgate's data plane: the mitmproxy addon, its Redis scripts, and the `kvgate` launcher."""
