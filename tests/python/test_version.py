"""metile.__version__ is the project() version of CMakeLists.txt, as `metile --version` prints it
(tests/unit/startup/CMakeLists.txt, ctest cli_version)."""
import re

import metile


def test_version_is_the_projects(source_dir):
    declared = re.search(r"project\(metile VERSION ([0-9.]+)", (source_dir / "CMakeLists.txt").read_text())
    assert declared is not None
    assert metile.__version__ == declared.group(1)
