"""kvgate's data plane: the mitmproxy addon and the `kvgate` launcher (Redis access is in `store`)."""
