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
import stat
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


DECISION_FILE_VERSION = 2  # decision_file_version in src/dispatch/decision_cache.cpp


def finite_number(value):
    """A JSON number as a finite float (an integer past a double's range, 1 and 400 zeros, is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def is_candidate(value):
    """A typed candidate identity, as candidate_from_json in C++ reads one."""
    return (isinstance(value, dict) and value.get("kind") in ("native", "fused") and
            value.get("replay") in ("eager", "graph") and isinstance(value.get("variant"), str))


def races(document):
    """(key, chosen, [(milliseconds, candidate)]) for each decision; ValueError says what is malformed.
    A file is taken exactly where the C++ reader takes it (src/dispatch/decision_cache.cpp): the integer
    version 2, and each decision's key, chosen candidate, report and timings, every candidate a typed
    identity and every timing a finite number; the C++ reader ignores any other file and replaces it."""
    if not isinstance(document, dict) or not isinstance(document.get("decisions"), list):
        raise ValueError("not an object with a list of decisions")
    version = document.get("version")
    if type(version) is not int or version != DECISION_FILE_VERSION:  # 2.0 and True are not 2 in C++ either
        raise ValueError(f"version {printable(repr(version))}, not {DECISION_FILE_VERSION}")
    for index, decision in enumerate(document["decisions"]):
        if (not isinstance(decision, dict) or not isinstance(decision.get("key"), str) or
                not is_candidate(decision.get("chosen")) or not isinstance(decision.get("report"), str)):
            raise ValueError(f"decision {index} is not an object with a key, a chosen candidate and a report")
        timings = decision.get("timings_ms")
        if not isinstance(timings, list):
            raise ValueError(f"decision {index} has no list timings_ms")
        pairs = []
        for pair in timings:
            milliseconds = finite_number(pair[1]) if isinstance(pair, list) and len(pair) == 2 else None
            if milliseconds is None or not is_candidate(pair[0]):
                raise ValueError(f"decision {index}: a timing is not a [candidate, finite milliseconds] pair")
            pairs.append((milliseconds, pair[0]))
        yield decision["key"], decision["chosen"], pairs


def candidate_name(candidate):
    """What WORDS are looked for in: the candidate's own names, not the JSON around them."""
    return f"{candidate['kind']} {candidate['variant']} {candidate['replay']}"


def account_home():
    """The account's home from the password database (C++'s getpwuid), None where there is none or it is /."""
    try:
        import pwd

        home = pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return None
    return home if home.startswith("/") and home != "/" else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*", help="print only races with a candidate whose name holds one of these")
    # As cache_directory() in C++ (src/runtime/cuda/nvrtc_compile.cpp): "" is unset, and without a HOME
    # (unset or empty) the account's home from the password database, else /tmp/metile-cache-UID.
    home = os.environ.get("HOME") or account_home()
    cache = os.environ.get("METILE_CACHE_DIR") or (
        os.path.join(home, ".cache", "metile") if home else f"/tmp/metile-cache-{os.getuid()}")
    parser.add_argument("--file", default=os.path.join(cache, "dispatch.json"))
    parser.add_argument("--top", type=positive, default=8, help="how many of the fastest candidates to print (default 8)")
    arguments = parser.parse_args()
    try:
        # Only a regular file is opened: a FIFO in its place waited forever for a writer (as the C++
        # reader did before it checked the same).
        if not stat.S_ISREG(os.stat(arguments.file).st_mode):
            raise ValueError("not a regular file")
        with open(arguments.file, "rb") as stream:
            data = stream.read(MAXIMUM_BYTES + 1)
        if len(data) > MAXIMUM_BYTES:
            raise ValueError(f"larger than the {MAXIMUM_BYTES}-byte limit")
        document = json.loads(data.decode("utf-8-sig"))  # a leading BOM, as nlohmann skips it
        listed = list(races(document))
    except (OSError, ValueError, RecursionError) as error:
        sys.exit(f"print_races.py: cannot read {printable(arguments.file)}: {printable(str(error))}")
    try:
        for key, chosen, pairs in listed:
            names = [candidate_name(candidate) for _, candidate in pairs]
            if arguments.words and not any(word in name for name in names for word in arguments.words):
                continue
            print(f"{printable(key)[:70]}\n  chosen: {candidate_text(chosen)}")
            for milliseconds, candidate in sorted(pairs, key=lambda pair: pair[0])[: arguments.top]:
                print(f"  {milliseconds * 1000:8.2f} us  {candidate_text(candidate)}")
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    main()
