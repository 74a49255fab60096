"""PEP 517 build backend: the repository root builds the patched DeepSpeed, deepspeed 0.19.8+keepfp32.

`pip install .`, `pip install git+<this repository>` and a requirements line `deepspeed @ git+...` come here. The
backend takes DeepSpeed's 0.19.8 sdist (the file named by $DS_SDIST, else build/cache/ when `make setup` left it
there, else `pip download` from the index pip is configured with), checks it against the sha256 pinned in
requirements/upstream.txt, unpacks it into a temporary folder, applies patches/series there (`git apply`, else
`patch`), and builds the wheel the way pip builds DeepSpeed's own sdist: setuptools' legacy backend running its
setup.py, with DS_BUILD_OPS=0 (ops are JIT-built on first use) and DS_BUILD_STRING=+keepfp32.

DeepSpeed's setup.py does not need torch when no op is pre-built: in pip's isolated build environment it records
torch 0.0 in git_version_info_installed.py (as `pip install deepspeed` does); `pip install --no-build-isolation .`
records the torch it finds. setup.py leaves git_hash and git_branch "unknown" when DS_BUILD_STRING is set; this
backend writes the series' identity there instead (the repository's commit when built from a git checkout, and
the sha256 of the applied patches), which `ds_report` shows as "deepspeed info".
"""

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME, VERSION, BUILD_STRING = "deepspeed", "0.19.8", "+keepfp32"
SDIST = f"{NAME}-{VERSION}.tar.gz"
INSTALLED_INFO = "deepspeed/git_version_info_installed.py"


def _say(msg):
    print(f"keepfp32_build: {msg}", file=sys.stderr, flush=True)


def _pinned_sha256():
    with open(os.path.join(ROOT, "requirements", "upstream.txt")) as f:
        m = re.search(r"--hash=sha256:([0-9a-f]{64})", f.read())
    if not m:
        raise RuntimeError("requirements/upstream.txt pins no sha256 for the DeepSpeed sdist")
    return m.group(1)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _local_sdist():
    for path in (os.environ.get("DS_SDIST"), os.path.join(ROOT, "build", "cache", SDIST)):
        if path and os.path.isfile(path):
            return path
    if os.environ.get("DS_SDIST"):
        raise RuntimeError(f"DS_SDIST={os.environ['DS_SDIST']}: no such file")
    return None


def _fetch_sdist(tmp):
    """The verified sdist: a local one, or one pip downloads from the configured index."""
    path = _local_sdist()
    if path is None:
        _say(f"downloading {SDIST} with pip (--require-hashes, requirements/upstream.txt)")
        subprocess.run([
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "--require-hashes",
            "-r",
            os.path.join(ROOT, "requirements", "upstream.txt"), "-d", tmp
        ],
                       check=True,
                       stdout=sys.stderr)
        path = os.path.join(tmp, SDIST)
    have, want = _sha256(path), _pinned_sha256()
    if have != want:
        raise RuntimeError(f"{path}: sha256 {have}, expected {want} (requirements/upstream.txt)")
    return path


def _series():
    """The patch files of patches/series, in order."""
    series = os.path.join(ROOT, "patches", "series")
    if not os.path.isfile(series):
        return []
    with open(series) as f:
        names = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    return [os.path.join(ROOT, "patches", n) for n in names]


def _apply(tree, patches):
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(tree))  # never the repo around a temp folder
    if shutil.which("git"):
        cmd = ["git", "apply", "--whitespace=nowarn"]
    elif shutil.which("patch"):
        cmd = ["patch", "-p1", "--batch", "--forward", "--quiet", "-i"]
    else:
        raise RuntimeError("applying patches/ needs git or patch on PATH")
    for p in patches:
        r = subprocess.run(cmd + [p], cwd=tree, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{os.path.basename(p)} does not apply to DeepSpeed {VERSION}:\n{r.stdout}{r.stderr}")


def _identity(patches):
    """(git_hash, git_branch) for git_version_info_installed.py: which series this build is."""
    h = hashlib.sha256()
    for p in patches:
        with open(p, "rb") as f:
            h.update(f.read())
    series = h.hexdigest()[:12]
    commit = None
    try:
        top = subprocess.run(["git", "-C", ROOT, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if top.returncode == 0 and os.path.samefile(top.stdout.strip(), ROOT):
            commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"],
                                    capture_output=True,
                                    text=True).stdout.strip() or None
    except OSError:  # no git
        pass
    return commit or f"series-{series}", f"keepfp32 series: {len(patches)} patches, sha256 {series}"


def _rewrite_installed_info(wheel, git_hash, git_branch):
    """Write git_hash and git_branch into the wheel's git_version_info_installed.py (and its RECORD line)."""
    with zipfile.ZipFile(wheel) as z:
        entries = [(i, z.read(i.filename)) for i in z.infolist()]
    record_name = next(i.filename for i, _ in entries if i.filename.endswith(".dist-info/RECORD"))
    out = []
    for info, data in entries:
        if info.filename == INSTALLED_INFO:
            text = data.decode()
            text = re.sub(r"(?m)^git_hash=.*$", f"git_hash={git_hash!r}", text)
            text = re.sub(r"(?m)^git_branch=.*$", f"git_branch={git_branch!r}", text)
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            new_record = (INSTALLED_INFO, f"sha256={digest}", str(len(data)))
        out.append((info, data))
    rows = []
    for info, data in out:
        if info.filename == record_name:
            rows = [new_record if row and row[0] == INSTALLED_INFO else row
                    for row in csv.reader(io.StringIO(data.decode()))]
    tmp = wheel + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in out:
            if info.filename == record_name:
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                data = buf.getvalue().encode()
            z.writestr(info, data)
    os.replace(tmp, wheel)


def _build_env():
    env = dict(os.environ, DS_BUILD_OPS="0", DS_BUILD_STRING=BUILD_STRING)
    try:
        import torch  # noqa: F401
    except ImportError:
        # DeepSpeed's accelerator classes need torch; without it setup.py falls back to its own detection.
        env.pop("DS_ACCELERATOR", None)
    return env


def get_requires_for_build_wheel(config_settings=None):
    # setuptools and wheel come from [build-system] requires; pip downloads the sdist when none is at hand.
    # Not torch: DeepSpeed's setup.py needs it only to pre-build ops, which this build does not.
    import importlib.util
    return ["pip"] if _local_sdist() is None and importlib.util.find_spec("pip") is None else []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    patches = _series()
    with tempfile.TemporaryDirectory(prefix="keepfp32-build-") as tmp:
        sdist = _fetch_sdist(tmp)
        tree = os.path.join(tmp, "src")
        with tarfile.open(sdist) as t:
            t.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        os.rename(os.path.join(tmp, f"{NAME}-{VERSION}"), tree)
        _apply(tree, patches)
        _say(f"applied {len(patches)} patches to DeepSpeed {VERSION}; building its wheel (DS_BUILD_OPS=0)")
        dist = os.path.join(tmp, "dist")
        driver = ("import sys\nfrom setuptools.build_meta import __legacy__ as backend\n"
                  "print('WHEEL=' + backend.build_wheel(sys.argv[1]))\n")
        r = subprocess.run([sys.executable, "-c", driver, dist],
                           cwd=tree,
                           env=_build_env(),
                           stdout=subprocess.PIPE,
                           text=True)
        sys.stderr.write(r.stdout)
        if r.returncode != 0:
            raise RuntimeError("DeepSpeed's setup.py failed (its output is above)")
        name = re.findall(r"^WHEEL=(.*)$", r.stdout, re.M)[-1]
        if not name.startswith(f"{NAME}-{VERSION}{BUILD_STRING}-"):
            raise RuntimeError(f"built {name}, expected {NAME}-{VERSION}{BUILD_STRING}")
        _rewrite_installed_info(os.path.join(dist, name), *_identity(patches))
        shutil.move(os.path.join(dist, name), os.path.join(wheel_directory, name))
    return name


SDIST_FILES = ["pyproject.toml", "README.md", "docs/install.md", "requirements/upstream.txt", "backend", "patches"]


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_sdist(sdist_directory, config_settings=None):
    """An sdist of this repository: the backend, the pin and the patches (DeepSpeed's source is fetched later)."""
    base = f"{NAME}-{VERSION}{BUILD_STRING}"
    pkg_info = f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}{BUILD_STRING}\n".encode()
    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as t:
        for rel in SDIST_FILES:
            if os.path.exists(os.path.join(ROOT, rel)):
                t.add(os.path.join(ROOT, rel),
                      f"{base}/{rel}",
                      filter=lambda i: None if "__pycache__" in i.name else i)
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        t.addfile(info, io.BytesIO(pkg_info))
    return os.path.basename(path)
