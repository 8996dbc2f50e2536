"""README.md and docs/ stay navigable and true (issue 30).

Every relative link resolves, to a file and, where it names one, to a heading of it;
the generated pages are what the code generates now; every shell example that cannot
run here (vLLM, kubectl, the install) is at least checked against what it calls: a
``kvindex`` command line parses with kvindex's own parser, a vLLM ``--kv-events-config``
is JSON. ``tests/test_readme_examples.py`` runs the examples that can run.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from kvindex.api import docs_gen
from kvindex.api.serve.cli import build_parser
from kvindex.api.serve.settings_sources import decode_settings

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Commands the examples show that this machine cannot run (a GPU, a cluster, the
# install itself), and that CI runs elsewhere (.ci/run runs the README's test command).
ELSEWHERE = ("vllm ", "kubectl ", "python3 -m venv", ".venv/bin/pip ", ".venv/bin/python -m pytest")
ELSEWHERE += ("bash tests/conformance/vllm_env.sh",)
RUN_BY_THE_EXAMPLES_TEST = re.compile(r"^(curl|python3? -c) ")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text("utf-8"))
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base, n = slug(heading), 0
        while (name := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(name)
    return found


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in [*PAGES, ROOT / "deploy" / "README.md", ROOT / "bench" / "README.md"]:
        for target in LINK.findall(FENCE.sub("", page.read_text("utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check offline
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_check_catches_a_broken_anchor(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    page.write_text("# The `kvindex` gateway: P/D\n\n## Errors and settings\n")
    assert anchors(page) == {"the-kvindex-gateway-pd", "errors-and-settings"}


def test_the_generated_pages_are_current() -> None:
    # This checkout's docs/: docs_gen's own default is found from its file, which in a
    # non-editable install (.ci/run's pure venv) is site-packages, not the checkout.
    stale = docs_gen.stale(ROOT / "docs")
    assert not stale, f"stale: {', '.join(stale)}; regenerate with `{docs_gen.COMMAND}`"


def test_every_setting_and_path_is_on_the_generated_pages() -> None:
    reference = (ROOT / "docs" / "configuration-reference.md").read_text("utf-8")
    for leaf in docs_gen.LEAVES.values():
        assert f"`{leaf.section}.{leaf.field}`" in reference or f"`{leaf.field}`" in reference
    api = (ROOT / "docs" / "api.md").read_text("utf-8")
    for path in ("/score", "/route", "/index/pods/{pod}", "/healthz", "/metrics"):
        assert f" {path}`" in api, path
    assert "## Error codes" in api and "`unsupported_media_type`" in api


def commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comment lines dropped,
    ``&&`` chains split."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out: list[str] = []
    pending = ""
    for line in joined.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            out += [part.strip() for part in pending.split(" && ")]
        pending = ""
    return out


def shell_blocks() -> list[tuple[str, str]]:
    return [
        (page.name, body)
        for page in PAGES
        for lang, body in FENCE.findall(page.read_text("utf-8"))
        if lang in ("sh", "bash")
    ]


def test_every_shell_example_is_checked() -> None:
    """Each command is run by test_readme_examples.py, parsed by kvindex's parser, or
    one of the kinds that run elsewhere, whose shell syntax at least is checked."""
    parser = build_parser()
    parsed = 0
    for page, block in shell_blocks():
        syntax = subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True)
        assert syntax.returncode == 0, (page, block, syntax.stderr)
        for command in commands(block):
            words = shlex.split(command, comments=True)
            if RUN_BY_THE_EXAMPLES_TEST.match(command):
                continue
            if Path(words[0]).name == "kvindex":
                try:
                    parser.parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f"{page}: {command!r} does not parse")
                parsed += 1
            elif command.startswith(("vllm ", "python3 -m sglang.launch_server ")):
                config = words[words.index("--kv-events-config") + 1]
                events = json.loads(config)
                if command.startswith("vllm "):
                    assert events["enable_kv_cache_events"] is True, (page, command)
                else:  # SGLang has no switch: it publishes once a publisher is named
                    assert events["publisher"] == "zmq", (page, command)
            else:
                assert command.startswith(ELSEWHERE), f"{page}: who checks {command!r}?"
    assert parsed >= 4


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    """.ci/run runs the README's command verbatim, before any other test run (the pure
    venv's comes after it)."""
    readme = (ROOT / "README.md").read_text("utf-8")
    lines = (ROOT / ".ci" / "run").read_text("utf-8").splitlines()
    ci_command = lines[lines.index("# The README's test command, verbatim:") + 1]
    assert f"```sh\n{ci_command}\n```" in readme
    runs = [line for line in lines if "pytest" in line and not line.lstrip().startswith("#")]
    assert runs[0] == ci_command


def test_python_examples_import_what_they_name() -> None:
    """``kvindex.api.client`` is the client's module; an example naming another fails."""
    for page in PAGES:
        for lang, body in FENCE.findall(page.read_text("utf-8")):
            if lang != "python":
                continue
            for line in body.splitlines():
                if re.match(r"(from \S+ )?import ", line) and "kvindex" in line:
                    exec(compile(line, page.name, "exec"), {})


def test_config_file_examples_decode(tmp_path: Path) -> None:
    """Every YAML example with a ``models:`` or section table is a valid config file."""
    checked = 0
    for page in PAGES:
        for lang, body in FENCE.findall(page.read_text("utf-8")):
            if lang != "yaml" or not re.search(r"^(models|scoring|http):", body, re.M):
                continue
            path = tmp_path / f"{page.stem}-{checked}.yaml"
            path.write_text(body)
            assert yaml.safe_load(body)
            decode_settings({"model_config": str(path)}, {})
            checked += 1
    assert checked >= 2
