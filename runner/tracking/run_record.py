"""The run record: what a run needs, beside its spec, to be recreated and to tell why a rerun differs.

Logged by the tracker when a run starts (rank 0 only): the git commit of the working directory (and of
runner's own source when that is another checkout) with the uncommitted diff, package versions, the
hardware, the data's identity, and the sha256 of the source of every module the run imported from
outside the Python installation (its standard library and site-packages): a user's model file that git
does not track changes no commit and no `git diff HEAD`, only its own checksum. `runner reproduce` (runner/results/reproduce.py) compares it with now.
Everything here is cheap (a few git calls and stat calls): a dataset folder is walked at most
_MAX_FILES entries deep, and only files under _HASH_LIMIT bytes are hashed.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
from glob import glob
from importlib import metadata
from pathlib import Path
from typing import Any

RECORD_FILE = "record/run_record.json"
DIFF_FILE = "record/git_diff.patch"
PACKAGES = ("torch", "torchvision", "runner", "hydra-core", "omegaconf", "optuna", "mlflow", "numpy", "scikit-learn",
            "timm", "transformers", "tokenizers")
TAGGED_PACKAGES = ("torch", "torchvision", "runner", "hydra-core", "optuna", "mlflow", "numpy")
_HASH_LIMIT = 50 * 2**20  # smaller files get a checksum; larger ones, and folders, size and mtime
_MAX_FILES = 20_000       # a folder holding more is described by its first ones (and says so): ~50 ms of stat calls
# dataset params that name files or folders (a user's dataset may use any key ending like these)
_PATH_KEYS = ("root", "files", "path", "dir", "file", "tokenizer")


def git_state(directory: Path) -> dict[str, Any]:
    """The commit of the repository holding directory, and its uncommitted diff against HEAD."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    found = git("rev-parse", "--show-toplevel", "HEAD")  # one call: a repository without commits fails it
    if found is None:
        top = git("rev-parse", "--show-toplevel")
        return {"repo": top.strip() if top else None, "commit": None, "diff": ""}
    top, commit = found.splitlines()[:2]
    return {"repo": top, "commit": commit, "diff": git("diff", "HEAD") or ""}


def packages() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def hardware() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out: dict[str, Any] = {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(), "gpus": [],
                           "cuda": None}
    torch = sys.modules.get("torch")  # never imported here for this: a run has it already, a CLI may not need it
    if torch is not None:
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def data_identity(dataset: dict[str, Any]) -> dict[str, Any]:
    """The dataset option's params, and for each param naming existing files or folders: their size and
    newest modification time, or a sha256 for a file under 50 MB. No paths: a built-in or generated set,
    which its params (and the package versions) identify."""
    paths: dict[str, Any] = {}
    for key, value in sorted(dataset.items()):
        if not any(key == k or key.endswith(f"_{k}") for k in _PATH_KEYS):
            continue
        for text in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(text, str) and text:
                described = describe_path(text)
                if described is not None:
                    paths[f"{key}:{text}"] = described
    return {"params": dataset, "paths": paths, "kind": "files" if paths else "built-in (identified by its params)"}


def describe_path(text: str) -> dict[str, Any] | None:
    matches = sorted(glob(text, recursive=True)) if any(c in text for c in "*?[") else [text]
    files: list[os.stat_result] = []
    truncated = False
    single = None
    for match in matches:
        path = Path(match)
        if path.is_file():
            single = path if len(matches) == 1 else None
            files.append(path.stat())
        elif path.is_dir():
            truncated |= _walk(path, files)
    if not files and single is None:
        return None
    if single is not None and files[0].st_size < _HASH_LIMIT:
        return {"sha256": _sha256(single), "bytes": files[0].st_size}
    out = {"files": len(files), "bytes": sum(s.st_size for s in files),
           "newest_mtime": max((s.st_mtime for s in files), default=0.0)}
    if truncated:
        out["note"] = f"only the first {_MAX_FILES} files were looked at"
    return out


def imported_sources() -> dict[str, dict[str, str]]:
    """{module name: {"file", "sha256"}} of every module imported so far whose file lies outside the Python
    installation (the standard library, site-packages): runner's, the built-in models' and data's, the user's."""
    installed = _installation_dirs()
    out: dict[str, dict[str, str]] = {}
    real_folders: dict[str, str] = {}
    # a copy, as sys.modules' documentation asks: the record is built on the tracking writer's thread while
    # the training thread may be importing (list(sys.modules.items()) raised "dictionary changed size")
    for name, module in sorted(sys.modules.copy().items()):
        if name in ("__main__", "__mp_main__"):  # the script itself: its module name says nothing about it later
            continue
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not os.path.isfile(file):
            continue  # built into the interpreter, a namespace package
        real = _real_path(file, real_folders)
        if real.startswith(installed) or _INSTALLED_PARTS & set(real.split(os.sep)):
            continue
        out[name] = {"file": os.path.abspath(file), "sha256": _sha256(Path(file))}
    return out


_INSTALLED_PARTS = {"site-packages", "dist-packages"}


def _real_path(file: str, real_folders: dict[str, str]) -> str:
    """os.path.realpath(file), each folder resolved once (kept in real_folders): realpath takes an lstat per part of
    every path, 55 ms of CPU for the ~2,200 modules of a run, on the writer's thread beside training."""
    if os.path.islink(file):
        return os.path.realpath(file)
    folder, name = os.path.split(file)
    real = real_folders.get(folder)
    if real is None:
        real = real_folders[folder] = os.path.realpath(folder)
    return os.path.join(real, name)


def sources_now(recorded: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The recorded modules' checksums now: of the same file (a module the run imported need not be imported
    where this runs), or, where that path is gone (another checkout), of the file the module's name finds now."""
    import importlib.util

    out = {}
    for name, entry in recorded.items():
        file = entry["file"]
        if not os.path.isfile(file):
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            file = spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None
        out[name] = {"file": file or entry["file"], "sha256": _sha256(Path(file)) if file else "missing"}
    return out


def _installation_dirs() -> tuple[str, ...]:
    dirs = set()
    for base in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=base) if base else sysconfig.get_paths()
        dirs.update(os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")
                    if k in paths)
    return tuple(sorted(dirs))


def _walk(root: Path, files: list[os.stat_result]) -> bool:
    """Stat every file under root (os.scandir: one system call per entry); True when cut short."""
    stack = [str(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            elif entry.is_file():
                files.append(entry.stat())
                if len(files) >= _MAX_FILES:
                    return True
    return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(spec: Any, cwd: Path | None = None) -> dict[str, Any]:
    """The record of a run of spec started in cwd (default: this process's working directory)."""
    cwd = Path.cwd() if cwd is None else cwd
    work = git_state(cwd)
    source = git_state(Path(__file__).resolve().parent)
    record = {"git": {"cwd": str(cwd), "repo": work["repo"], "commit": work["commit"],
                      "diff_sha256": hashlib.sha256(work["diff"].encode()).hexdigest() if work["diff"] else None},
              "packages": packages(), "hardware": hardware(),
              "data": data_identity({k: v for k, v in spec.dataset.__to_plain__().items()
                                     if k not in ("batch_size", "num_workers")}),
              "sources": imported_sources()}
    if source["repo"] is not None and source["repo"] != work["repo"]:
        record["git"]["runner_source"] = {"repo": source["repo"], "commit": source["commit"],
                                          "dirty": bool(source["diff"])}
    record["git"]["diff"] = work["diff"]  # logged as its own artifact, not inside the JSON
    return record


def tags(record: dict[str, Any]) -> dict[str, str]:
    git = record["git"]
    unknown = f"none (no commit yet in {git['repo']})" if git["repo"] else f"none (not a git repository: {git['cwd']})"
    out = {"git_commit": git["commit"] or unknown,
           "git_dirty": "true" if git.get("diff_sha256") else "false"}
    if "runner_source" in git:
        out["runner.source_commit"] = git["runner_source"]["commit"] or "none"
    out.update({f"version.{name}": v for name, v in record["packages"].items() if name in TAGGED_PACKAGES})
    hw = record["hardware"]
    out.update({"hardware.cpu": f"{hw['cpu']} x{hw['cpu_count']}", "hardware.gpus": ", ".join(hw["gpus"]) or "none",
                "hardware.cuda": hw["cuda"] or "none", "data.kind": record["data"]["kind"]})
    return out

