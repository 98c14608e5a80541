"""Every shell script under examples/ is valid bash (the ones that train are run by hand or by CI's main job)."""

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "examples").rglob("*.sh"))


def test_the_examples_have_scripts():
    assert {p.name for p in SCRIPTS} >= {"run.sh", "own_rm.sh", "reward_hacking.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_example_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
