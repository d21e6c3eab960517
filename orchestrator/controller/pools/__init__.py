"""Node pools: where node agents run. Each fills in the controller's ``NodePool`` protocol (api.py)."""

import re

DEATH_SIGNAL = re.compile(r"Received (\S+) death signal")  # torchrun's log line when a signal stops it
