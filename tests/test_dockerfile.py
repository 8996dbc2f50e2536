"""The Dockerfile, checked without a Docker engine: its shape, then its own commands.

No Docker runs on the development machines, so the image is verified the other way
round: the Dockerfile is parsed, and the exact RUN commands of both stages and the exact
ENTRYPOINT are run here - the wheel build in a copy of the build context, the install
into a fresh virtual environment, the service started from there (not from the source
tree) until ``GET /healthz`` answers. Only the paths differ: ``/wheels`` and the build
stage's WORKDIR become temporary directories, and ``pip``/``kvindex`` resolve to the
environment being built, as they do in the image.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvindex.api.testing import ServeProcess, free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Stage:
    image: str
    name: str | None
    args: dict[str, str] = field(default_factory=dict)
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.steps if ins == instruction]


def logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return lines


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def parse(text: str) -> list[Stage]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            target = stages[-1].args if stages else global_args
            target[name] = default.strip('"') or global_args.get(name, "")
        elif instruction == "FROM":
            words = substitute(rest, global_args).split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        else:
            assert stages, f"{instruction} before FROM"
            stages[-1].steps.append((instruction, rest))
    return stages


def run_command(rest: str, args: dict[str, str]) -> tuple[list[str], str]:
    """A RUN's ``--mount=`` flags and its shell command, ARGs expanded."""
    flags = []
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
    return flags, substitute(rest.strip(), args)


def env_of(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for rest in stage.all("ENV"):
        for word in shlex.split(rest):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def dockerignore_allows(path: str) -> bool:
    """Whether .dockerignore lets ``path`` into the build context (last match wins)."""
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse((ROOT / "Dockerfile").read_text())


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    out = []
    for rest in stage.all("COPY"):
        words = rest.split()
        assert not any(w.startswith("--from") for w in words)
        out.append((words[:-1], words[-1]))
    return out


# -- shape ---------------------------------------------------------------------------------


def test_two_stages_slim_non_root_exec_entrypoint(stages: list[Stage]) -> None:
    build, final = stages
    assert build.name and "slim" in final.image
    # The build stage compiles the table kernels: the full image of the same Python and
    # Debian release (it has gcc), so the wheel it builds installs on the slim one.
    assert build.image == final.image.replace("-slim", "")
    user = final.all("USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric, so runAsNonRoot can verify it"
    exposed = {int(p) for rest in final.all("EXPOSE") for p in rest.split()}
    assert {8080, 5557} <= exposed
    entrypoint = json.loads(final.all("ENTRYPOINT")[-1])
    assert entrypoint == ["kvindex", "serve"]
    # kvindex listens on 127.0.0.1 unless told; the image must serve its EXPOSEd port.
    assert env_of(final)["KVINDEX_LISTEN"] == "0.0.0.0:8080"
    assert not final.all("COPY") and not final.all("ADD"), "the image gets only the install"
    for rest in final.all("RUN"):
        flags, command = run_command(rest, final.args)
        assert not re.search(r"apt-get|apk |gcc|build-essential|\bgit\b", command)
        assert "--no-index" in command, "the final stage must not download anything"
        assert f"--mount=type=bind,from={build.name},source=/wheels,target=/wheels" in flags


def test_build_stage_copies_every_package_and_the_context_allows_it(stages) -> None:
    build = stages[0]
    sources = [s.rstrip("/") for srcs, _ in copies(build) for s in srcs]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = set(project["tool"]["setuptools"]["package-dir"].values())
    needed |= {"pyproject.toml", "setup.py", project["project"]["readme"]}
    assert needed <= set(sources), f"not copied: {needed - set(sources)}"
    for source in sources:
        assert (ROOT / source).exists(), source
        assert dockerignore_allows(source), f".dockerignore excludes {source}"
    for unwanted in ("tests", "bench", "deploy", ".git", ".venv", "kvindex.egg-info"):
        assert not dockerignore_allows(unwanted), f".dockerignore lets {unwanted} in"


# -- the exact commands --------------------------------------------------------------------


def shell(command: str, cwd: Path, env: dict[str, str], timeout: float) -> None:
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def clean_env(bin_dir: Path) -> dict[str, str]:
    """The caller's environment without anything that points Python at this checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("KVINDEX_")
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_dockerfile_commands_build_install_and_start(stages, tmp_path: Path) -> None:
    build, final = stages
    wheels = tmp_path / "wheels"
    workdir = tmp_path / "src"  # the build stage's WORKDIR
    assert build.all("WORKDIR") == ["/src"]
    for sources, dest in copies(build):
        # Docker: a directory source copies its contents into dest; files land in dest/.
        target = workdir / dest
        for source in sources:
            if (ROOT / source).is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(ROOT / source, target, ignore=ignore, dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target / Path(source).name)

    # Stage 1, verbatim but for the paths: the wheels of kvindex and its dependencies.
    (build_run,) = build.all("RUN")
    _, command = run_command(build_run, build.args)
    build_env = clean_env(Path(sys.executable).parent)
    shell(command.replace("/wheels", str(wheels)), workdir, build_env, 600)
    assert list(wheels.glob("kvindex-*.whl"))

    # Stage 2: a fresh environment stands for the image's Python.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (final_run,) = final.all("RUN")
    _, command = run_command(final_run, final.args)
    env = {**clean_env(venv / "bin"), **env_of(final)}
    shell(command.replace("/wheels", str(wheels)), tmp_path, env, 600)

    # Start it exactly as the image does (listening on loopback only, not 0.0.0.0).
    port = free_port()
    env["KVINDEX_LISTEN"] = f"127.0.0.1:{port}"
    entrypoint = json.loads(final.all("ENTRYPOINT")[-1])
    with ServeProcess(
        port=port, command=entrypoint, listen_flag=False, env=env, cwd=tmp_path
    ) as server:
        server.wait_ready(60.0, path="/healthz")
        answer = httpx.get(f"{server.url}/healthz", timeout=5)
        assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        module = subprocess.run(
            [str(venv / "bin/python"), "-c", "import kvindex.api; print(kvindex.api.__file__)"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert str(venv) in module, f"kvindex was imported from {module}, not the install"
        if shutil.which("cc") or shutil.which("gcc"):  # as in the build stage's image
            version = subprocess.run(
                ["kvindex", "--version"], env=env, capture_output=True, text=True, check=True
            ).stdout
            # the build stage's image has gcc and libssl-dev: every extension builds
            assert (
                "(compiled table, compiled hashing, compiled payloads, compiled receive, "
                "compiled token_ids, compiled route loop)" in version
            ), version
