"""scripts/gpu_ab.sh refuses a ROUNDS it would misread before it builds anything: the shell's
arithmetic took 010 for octal 8 (each run sized for 8 rounds while 10 ran, past AB_TIMEOUT), 08 for an
error and 00 for 0 (a division by zero), each only after both trees were built."""
import os
import pathlib
import subprocess

SCRIPT = pathlib.Path(os.environ.get("METILE_SOURCE_DIR", pathlib.Path(__file__).parents[2])) / "scripts" / "gpu_ab.sh"


def test_rounds_must_be_plain_decimal(tmp_path):
    for rounds in ("00", "08", "010", "0", "", "1x", "-1"):
        result = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "metile", rounds, "true"],
                                capture_output=True, text=True, check=False, env={**os.environ, "OUT": str(tmp_path / "out")})
        assert result.returncode == 2, (rounds, result.stderr)
        assert result.stderr == f"gpu_ab.sh: ROUNDS must be a whole number >= 1, not '{rounds}'\n", (rounds, result.stderr)
        assert not (tmp_path / "out").exists()
