"""The `mitmdump -s` script.

    mitmdump --mode reverse:http://127.0.0.1:1 -s plugin/entry.py --set kvgate_config=examples/kvgate.toml

mitmdump reloads `-s` scripts when their file changes, into a fresh instance that loses all state;
production should prefer `kvgate proxy` (plugin/launcher.py), which registers the addon in code.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from plugin.addon import KvGate
    from plugin.client_deadline import ClientDeadline
    from runtime import compat
except ImportError:  # run from a checkout without `pip install -e .`: the script dir is plugin/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from plugin.addon import KvGate
    from plugin.client_deadline import ClientDeadline
    from runtime import compat

compat.install()  # this script is the process's entry point here (mitmdump has none of ours)
addons = [ClientDeadline(), KvGate()]  # ClientDeadline sees a request before KvGate awaits admission
