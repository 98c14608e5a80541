"""The suite's last line is pytest's own summary (`N passed ...`), which CI tools read as the result: the line
naming the threads still alive comes above it (tests/conftest.py)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

LINGERING = '''
import threading, time

def test_leaves_a_daemon_thread():
    threading.Thread(target=time.sleep, args=(60,), name="lingering", daemon=True).start()
'''


def test_the_threads_line_comes_before_pytests_summary(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")  # the suite's hooks, in a session of one test
    (tmp_path / "test_lingering.py").write_text(LINGERING)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout
    assert re.fullmatch(r"1 passed in [0-9.]+s", lines[-1]), lines[-3:]
    threads = [i for i, line in enumerate(lines) if line.startswith("threads alive at the end of the session: ")]
    assert len(threads) == 1 and "lingering (daemon" in lines[threads[0]], lines  # still named, above the summary
