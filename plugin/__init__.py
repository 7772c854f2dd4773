"""kvgate's data plane: the mitmproxy addon, its Redis scripts, and the `kvgate` launcher."""

from plugin import compat

compat.install()  # first thing on import: Python 3.11's asyncio.wait_for can lose a task's cancel
