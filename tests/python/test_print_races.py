"""scripts/print_races.py reads the decision cache (src/dispatch/decision_cache.cpp writes it:
version, decisions of key, chosen, report and timings_ms as [candidate, milliseconds] pairs) and
prints each matching race fastest first; a missing file is one error line and exit status 1."""
import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(os.environ.get("METILE_SOURCE_DIR", pathlib.Path(__file__).parents[2])) / "scripts" / "print_races.py"


def candidate(kind, variant, replay):
    return {"kind": kind, "variant": variant, "replay": replay}


def run(*arguments):
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, check=False)


def test_races_print_fastest_first_and_filter_by_name(tmp_path):
    one = candidate("fused", "gemv w4 t1 f2 db", "eager")
    two = candidate("fused", "gemv w8 t1 f2 db resident3", "graph")
    native = candidate("native", "", "graph")
    document = {
        "version": 1,
        "decisions": [
            {"key": "qkv race", "chosen": one, "report": "r", "timings_ms": [[two, 0.013], [native, 0.1344], [one, 0.01176]]},
            {"key": "mlp race", "chosen": native, "report": "r", "timings_ms": [[native, 0.5]]},
        ],
    }
    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    result = run("--file", str(path), "resident3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "qkv race"
    assert "mlp race" not in result.stdout
    times = [line.split()[0] for line in lines[2:]]
    assert times == ["11.76", "13.00", "134.40"]
    assert "resident3" in lines[3]
    assert "mlp race" in run("--file", str(path)).stdout
    assert len(run("--file", str(path), "--top", "1").stdout.splitlines()) == 2 * (2 + 1)  # key, chosen, one time


def test_a_missing_file_is_one_error_line(tmp_path):
    result = run("--file", str(tmp_path / "none.json"))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("print_races.py: cannot read ")
    assert len(result.stderr.splitlines()) == 1


def test_a_file_that_is_not_a_decision_cache_is_one_error_line(tmp_path):
    """Malformed caches ended in tracebacks; /dev/zero was read without a limit."""
    cases = ["[]", "5", '{"decisions": {}}', '{"decisions": null}', '{"decisions": [5]}',
             '{"decisions": [{"timings_ms": [[{}, 1, 2]]}]}', '{"decisions": [{"timings_ms": [[{}, "1"]]}]}',
             '{"decisions": [{"timings_ms": [[{}, NaN]]}]}', '{"decisions": [{"timings_ms": [[{}, true]]}]}',
             "[" * 100000]
    for index, text in enumerate(cases):
        path = tmp_path / f"case{index}.json"
        path.write_text(text, encoding="utf-8")
        result = run("--file", str(path))
        assert result.returncode == 1, (text[:40], result.stdout, result.stderr)
        assert result.stderr.startswith("print_races.py: cannot read "), (text[:40], result.stderr)
        assert len(result.stderr.splitlines()) == 1, (text[:40], result.stderr)
    result = run("--file", "/dev/zero")
    assert result.returncode == 1 and "larger than the 67108864-byte limit" in result.stderr
    # A key's escape sequence reaches the terminal spelled; --top counts at least one candidate.
    path = tmp_path / "escape.json"
    path.write_text(json.dumps({"decisions": [{"key": "k\x1b[31m", "chosen": None, "timings_ms": [[{"a": 1}, 0.5]]}]}))
    result = run("--file", str(path))
    assert result.returncode == 0 and "\x1b" not in result.stdout and "k\\x1b[31m" in result.stdout
    path.write_text('{"decisions": [{"key": "\\ud800", "timings_ms": []}]}')  # a lone surrogate: spelled, no traceback
    result = run("--file", str(path))
    assert result.returncode == 0 and result.stdout.startswith("\\xd800\n"), result
    result = run("--file", str(path), "--top", "-1")
    assert result.returncode == 2 and "is not a count of at least 1" in result.stderr
