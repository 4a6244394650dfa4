"""Children started by ``engine/spawn.py`` do not import the parent's ``__main__`` (the CLI, under
``mlx-trio serve``); a plain spawn does."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

MAIN = """
import multiprocessing, os, sys
from pathlib import Path

with Path(sys.argv[1]).open("a") as imports:
    imports.write(f"{__name__}\\n")  # what every import of this module leaves

if __name__ == "__main__":
    from mlx_trio.engine import spawn

    context = multiprocessing.get_context("spawn")
    child = context.Process(target=os.getpid)
    (spawn.start if sys.argv[2] == "light" else type(child).start)(child)
    child.join()
    assert child.exitcode == 0
    assert __file__.endswith("main_module.py")  # given back once the child started
"""


def _imports_of_main(tmp_path: Path, start: str) -> list[str]:
    script = tmp_path / "main_module.py"
    script.write_text(textwrap.dedent(MAIN))
    record = tmp_path / f"imports-{start}.txt"
    subprocess.run([sys.executable, str(script), str(record), start], check=True, timeout=120)
    return record.read_text().split()


def test_a_child_spawned_through_start_does_not_import_the_parents_main(tmp_path):
    assert _imports_of_main(tmp_path, "plain") == ["__main__", "__mp_main__"]
    assert _imports_of_main(tmp_path, "light") == ["__main__"]
