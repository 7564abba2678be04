#!/usr/bin/env python3
"""Reads cargo's `--message-format=json...` messages on stdin and prints
"<target name> <executable>" for every executable cargo produced (what
scripts/gpu-bundle.sh and scripts/playground.sh ab-build copy)."""
import json
import sys

for line in sys.stdin:
    if not line.startswith("{"):
        continue
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
