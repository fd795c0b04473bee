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


NATIVE = json.dumps({"kind": "native", "variant": "", "replay": "graph"})


def run(*arguments):
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, check=False)


def test_races_print_fastest_first_and_filter_by_name(tmp_path):
    one = candidate("fused", "gemv w4 t1 f2 db", "eager")
    two = candidate("fused", "gemv w8 t1 f2 db resident3", "graph")
    native = candidate("native", "", "graph")
    document = {
        "version": 2,
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
    # WORDS are looked for in the candidates' names, not their JSON: "variant" matched every race, and
    # "résumé" none (json.dumps wrote it \u00e9).
    assert run("--file", str(path), "variant").stdout == ""
    document["decisions"][1]["timings_ms"].append([candidate("fused", "résumé", "eager"), 0.7])
    path.write_text(json.dumps(document), encoding="utf-8")
    assert run("--file", str(path), "résumé").stdout.splitlines()[0] == "mlp race"
    # A leading BOM is read, as the C++ reader reads it.
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(document).encode())
    assert run("--file", str(path)).returncode == 0
    # Piped into a reader that stops early: no traceback.
    many = {"version": 2, "decisions": [{"key": f"k{i}", "chosen": native, "report": "", "timings_ms": [[native, 1]]}
                                        for i in range(20000)]}
    path.write_text(json.dumps(many))
    piped = subprocess.run(f"'{sys.executable}' '{SCRIPT}' --file '{path}' | head -1", shell=True, capture_output=True,
                           text=True, check=False)
    assert piped.stdout == "k0\n" and piped.stderr == "", piped.stderr


def test_a_missing_file_is_one_error_line(tmp_path):
    result = run("--file", str(tmp_path / "none.json"))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("print_races.py: cannot read ")
    assert len(result.stderr.splitlines()) == 1


def test_a_file_that_is_not_a_decision_cache_is_one_error_line(tmp_path):
    """Malformed caches ended in tracebacks; /dev/zero was read without a limit."""
    def decision(timings):
        return '{"version": 2, "decisions": [{"key": "k", "chosen": null, "timings_ms": [' + timings + ']}]}'

    cases = ["[]", "5", '{"version": 2, "decisions": {}}', '{"version": 2, "decisions": null}',
             '{"version": 2, "decisions": [5]}', decision('[{}, 1, 2]'), decision('[{}, "1"]'),
             decision('[{}, NaN]'), decision('[{}, true]'), "[" * 100000,
             # A timing past a double's range ended in OverflowError's traceback.
             decision("[{}, 1" + "0" * 400 + "]"),
             # What the C++ reader refuses (another version, a decision without key or chosen, no
             # decisions at all) printed as races, or as nothing with status 0.
             '{"version": 99, "decisions": [{"key": "x", "chosen": "bogus", "timings_ms": []}]}', "{}",
             '{"decisions": []}', '{"version": true, "decisions": []}',
             '{"version": 2, "decisions": [{"chosen": 1, "timings_ms": []}]}',
             '{"version": 2, "decisions": [{"key": "x", "timings_ms": []}]}',
             # What the C++ reader also refuses, and the script printed: a chosen that is no candidate identity,
             # no report, no timings, a version that is 2 only when truncated (2.7) or wrapped (2^32 + 2).
             '{"version": 2, "decisions": [{"key": "x", "chosen": "bogus", "report": "r", "timings_ms": []}]}',
             '{"version": 2, "decisions": [{"key": "x", "chosen": ' + NATIVE + ', "timings_ms": []}]}',
             '{"version": 2, "decisions": [{"key": "x", "chosen": ' + NATIVE + ', "report": "r"}]}',
             '{"version": 2.7, "decisions": []}', '{"version": 4294967298, "decisions": []}',
             '{"version": 2.0, "decisions": []}']
    for index, text in enumerate(cases):
        path = tmp_path / f"case{index}.json"
        path.write_text(text, encoding="utf-8")
        result = run("--file", str(path))
        assert result.returncode == 1, (text[:40], result.stdout, result.stderr)
        assert result.stderr.startswith("print_races.py: cannot read "), (text[:40], result.stderr)
        assert len(result.stderr.splitlines()) == 1, (text[:40], result.stderr)
    # Only a regular file is opened: /dev/zero was read up to the limit, and a FIFO waited forever.
    result = run("--file", "/dev/zero")
    assert result.returncode == 1 and "not a regular file" in result.stderr
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, str(SCRIPT), "--file", str(fifo)], capture_output=True, text=True,
                            check=False, timeout=30)
    assert result.returncode == 1 and "not a regular file" in result.stderr
    large = tmp_path / "large.json"
    with open(large, "wb") as stream:
        stream.truncate((64 << 20) + 1)  # sparse: no disk
    result = run("--file", str(large))
    assert result.returncode == 1 and "larger than the 67108864-byte limit" in result.stderr
    # A key's escape sequence reaches the terminal spelled; --top counts at least one candidate.
    path = tmp_path / "escape.json"
    native = candidate("native", "", "graph")
    path.write_text(json.dumps({"version": 2, "decisions": [{"key": "k\x1b[31m", "chosen": native, "report": "r",
                                                          "timings_ms": [[native, 0.5]]}]}))
    result = run("--file", str(path))
    assert result.returncode == 0 and "\x1b" not in result.stdout and "k\\x1b[31m" in result.stdout
    path.write_text('{"version": 2, "decisions": [{"key": "\\ud800", "chosen": ' + json.dumps(native) +
                    ', "report": "", "timings_ms": []}]}')  # a lone surrogate
    result = run("--file", str(path))
    assert result.returncode == 0 and result.stdout.startswith("\\xd800\n"), result
    result = run("--file", str(path), "--top", "-1")
    assert result.returncode == 2 and "is not a count of at least 1" in result.stderr


def test_without_a_home_the_cache_is_where_cpp_looks(tmp_path):
    """cache_directory() in C++: $METILE_CACHE_DIR, else $HOME/.cache/metile, else (HOME unset or empty) the
    account's home from the password database; the script read ~ expanded by Python (/root/... or /.cache/...),
    and both used a shared /tmp/metile-cache another user could fill."""
    import pwd

    account = pwd.getpwuid(os.getuid()).pw_dir
    expected = (f"{account}/.cache/metile/dispatch.json" if account.startswith("/") and account != "/"
                else f"/tmp/metile-cache-{os.getuid()}/dispatch.json")
    environment = {key: value for key, value in os.environ.items() if key not in ("METILE_CACHE_DIR", "HOME")}
    for home in (None, ""):
        if home is not None:
            environment["HOME"] = home
        result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False,
                                env=environment)
        if result.returncode == 0:  # a cache this machine holds there was read
            assert os.path.isfile(expected), (home, result.stdout)
            continue
        assert f"cannot read {expected}" in result.stderr, (home, result.stderr)
    environment["HOME"] = str(tmp_path)
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False, env=environment)
    assert f"cannot read {tmp_path}/.cache/metile/dispatch.json" in result.stderr
