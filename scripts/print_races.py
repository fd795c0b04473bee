#!/usr/bin/env python3
"""Prints the region races recorded in the decision cache ($METILE_CACHE_DIR/dispatch.json, or the
path given with --file): for each decision whose candidates' names contain any of WORDS (all
decisions when none are given), the key, the chosen candidate and the fastest candidates' times.
Used on the device machine after `metile bench-model` to read a region's race, e.g.
    scripts/print_races.py resident3 rope
A file that is not a decision cache (src/dispatch/decision_cache.cpp writes it) is one error line."""
import argparse
import json
import math
import os
import sys

MAXIMUM_BYTES = 64 << 20  # as the C++ reader's limit for this file


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a count of at least 1")
    return value


def printable(text):
    """The text with its control characters as \\xNN: a key or name may hold an escape sequence."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def candidate_text(candidate):
    return printable(json.dumps(candidate, ensure_ascii=False))[:150]


def races(document):
    """(key, chosen, [(milliseconds, candidate)]) for each decision; ValueError says what is malformed."""
    if not isinstance(document, dict) or not isinstance(document.get("decisions", []), list):
        raise ValueError("not an object with a list of decisions")
    for index, decision in enumerate(document.get("decisions", [])):
        timings = decision.get("timings_ms", []) if isinstance(decision, dict) else None
        if not isinstance(timings, list):
            raise ValueError(f"decision {index} is not an object with a list timings_ms")
        pairs = []
        for pair in timings:
            if (not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[1], bool)
                    or not isinstance(pair[1], (int, float)) or not math.isfinite(pair[1])):
                raise ValueError(f"decision {index}: a timing is not a [candidate, finite milliseconds] pair")
            pairs.append((pair[1], pair[0]))
        yield str(decision.get("key", "")), decision.get("chosen"), pairs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*", help="print only races with a candidate whose name holds one of these")
    cache = os.environ.get("METILE_CACHE_DIR") or os.path.expanduser("~/.cache/metile")  # "" is unset, as in C++
    parser.add_argument("--file", default=os.path.join(cache, "dispatch.json"))
    parser.add_argument("--top", type=positive, default=8, help="how many of the fastest candidates to print (default 8)")
    arguments = parser.parse_args()
    try:
        with open(arguments.file, "rb") as stream:
            data = stream.read(MAXIMUM_BYTES + 1)
        if len(data) > MAXIMUM_BYTES:
            raise ValueError(f"larger than the {MAXIMUM_BYTES}-byte limit")
        document = json.loads(data.decode("utf-8"))
        listed = list(races(document))
    except (OSError, ValueError, RecursionError) as error:
        sys.exit(f"print_races.py: cannot read {printable(arguments.file)}: {printable(str(error))}")
    for key, chosen, pairs in listed:
        names = [json.dumps(candidate) for _, candidate in pairs]
        if arguments.words and not any(word in name for name in names for word in arguments.words):
            continue
        print(f"{printable(key)[:70]}\n  chosen: {candidate_text(chosen)}")
        for milliseconds, candidate in sorted(pairs, key=lambda pair: pair[0])[: arguments.top]:
            print(f"  {milliseconds * 1000:8.2f} us  {candidate_text(candidate)}")


if __name__ == "__main__":
    main()
