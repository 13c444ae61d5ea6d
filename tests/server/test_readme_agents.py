"""README's Agents section works as written: its `kvengine serve` flags start a real server on
the tiny model and its `openai` example runs against it unchanged (but for the URL)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from support.kvengine import REPO_ROOT, KvengineProcess


def _section() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("## Agents")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_agents_example_runs(tiny_model_dir: Path, tmp_path: Path) -> None:
    section = _section()
    command = re.search(r"^    (kvengine serve .*?)\n\n", section, re.S | re.M).group(1)
    args = shlex.split(command.replace("\\\n", " "))[2:]  # after `kvengine serve`
    args[args.index("--model") + 1] = str(tiny_model_dir)
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with KvengineProcess(*args, "--served-model-name", "tiny", "--max-model-len", "1024",
                         "--num-kv-blocks", "256") as server:
        script = tmp_path / "agents_example.py"
        script.write_text(example.replace("http://127.0.0.1:8000/v1", server.url + "/v1"))
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("tool_calls get_weather {'city': ")
    prompt_tokens, cached = map(int, lines[1].split())
    assert 300 <= cached <= prompt_tokens  # the agent loop's prefix (first prompt) was cached
    assert set(eval(lines[2])) == {"name", "age"}  # noqa: S307 (a dict printed by the example)
