#!/usr/bin/env python3
"""Prints the region races recorded in the decision cache ($METILE_CACHE_DIR/dispatch.json, or the
path given with --file): for each decision whose candidates' names contain any of WORDS (all
decisions when none are given), the key, the chosen candidate and the fastest candidates' times.
Used on the device machine after `metile bench-model` to read a region's race, e.g.
    scripts/print_races.py resident3 rope"""
import argparse
import json
import os
import sys

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("words", nargs="*", help="print only races with a candidate whose name holds one of these")
parser.add_argument("--file", default=os.path.join(os.environ.get("METILE_CACHE_DIR", os.path.expanduser("~/.cache/metile")), "dispatch.json"))
parser.add_argument("--top", type=int, default=8, help="how many of the fastest candidates to print (default 8)")
arguments = parser.parse_args()
try:
    with open(arguments.file, encoding="utf-8") as stream:
        document = json.load(stream)
except (OSError, ValueError) as error:
    sys.exit(f"print_races.py: cannot read {arguments.file}: {error}")
for decision in document.get("decisions", []):
    timings = decision.get("timings_ms", [])
    names = [json.dumps(candidate) for candidate, _ in timings]
    if arguments.words and not any(word in name for name in names for word in arguments.words):
        continue
    print(f"{decision.get('key', '')[:70]}\n  chosen: {json.dumps(decision.get('chosen'))[:150]}")
    for candidate, milliseconds in sorted(timings, key=lambda pair: pair[1])[: arguments.top]:
        print(f"  {milliseconds * 1000:8.2f} us  {json.dumps(candidate)[:150]}")
