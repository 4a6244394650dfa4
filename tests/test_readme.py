"""The README's in-process example runs as written, on the real default model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


@pytest.mark.e2e
def test_the_in_process_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "[stop," in result.stdout
    assert "{'batch': 4, 'serial': 0}" in result.stdout
