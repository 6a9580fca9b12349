"""Build every slide deck offline: slides/*.md -> slides/build/*.html, plus a PNG of each
deck's first slide rendered by headless Chromium, checked for not being blank.

    python slides/build.py            # all decks
    python slides/build.py 00_gpu_and_simulator.md

Needs Node with npm (``npm ci`` installs the pinned Marp CLI from package-lock.json; this script
runs it when node_modules is missing) and Chromium (CHROME_PATH, else chromium on the PATH).
A missing tool is named in one line, with what to install.
The HTML is made self-contained: local images are inlined as data: URIs, and the build
fails if any http(s) URL would be fetched at render time.
"""

from __future__ import annotations

import base64
import mimetypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SLIDES = Path(__file__).resolve().parent
REPO = SLIDES.parent
BUILD = SLIDES / "build"
CONFIG = SLIDES / "marp.config.yml"
RESULTS = REPO / "workbook" / "results"


class MissingImage(Exception):
    pass
# URLs that are names, not fetches (XML namespaces).
HARMLESS = re.compile(r"https?://www\.w3\.org/")
FETCHED = re.compile(r"""(?:src|href|srcset)\s*=\s*["']?\s*(https?:)?//|url\(\s*["']?\s*(?:https?:)?//|@import\s+["']?(?:url\()?\s*["']?https?:""", re.I)
LICENCE_NOTE = re.compile(r"/\*!+\s*License:[^*]*\*/")  # a comment naming where the licence text is
ANY_URL = re.compile(r"https?://[^\s\"'<>)]+")


def run(cmd, **kw):
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# What to install when a tool is missing: one line, no traceback.
NODE_HINT = "install Node.js with npm (https://nodejs.org, or your package manager: apt-get install -y nodejs npm)"
CHROME_HINT = "install Chromium (apt-get install -y chromium) or set CHROME_PATH to a Chromium or Chrome binary"


def marp_bin() -> Path:
    """The pinned Marp CLI, installed by ``npm ci`` when node_modules/ is missing."""
    exe = REPO / "node_modules" / ".bin" / "marp"
    if not shutil.which("node"):
        sys.exit(f"slides: no Node.js found (the Marp CLI runs on it): {NODE_HINT}")
    if not exe.exists():
        if not shutil.which("npm"):
            sys.exit(f"slides: no npm found to install the Marp CLI into node_modules/: {NODE_HINT}")
        try:
            run(["npm", "ci", "--no-audit", "--no-fund"], cwd=REPO)
        except subprocess.CalledProcessError as exc:
            sys.exit(f"slides: `npm ci` failed (exit {exc.returncode}): it needs the npm registry once, "
                     "to install the Marp CLI pinned in package-lock.json")
    return exe


def chrome_path() -> str:
    """CHROME_PATH if it names a program, else the first Chromium or Chrome on the PATH."""
    given = os.environ.get("CHROME_PATH")
    if given:
        path = given if os.path.isfile(given) and os.access(given, os.X_OK) else shutil.which(given)
        if not path:
            sys.exit(f"slides: CHROME_PATH={given} is not a program: {CHROME_HINT}")
        return path
    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not path:
        sys.exit(f"slides: no Chromium found (it renders each deck's first slide): {CHROME_HINT}")
    return path


def inline_local_images(html: str, deck: Path) -> str:
    """Replace relative image references (relative to the deck's folder) by data: URIs."""

    def data_uri(ref: str) -> str | None:
        if re.match(r"^(?:[a-z]+:|//|#)", ref, re.I):
            return None
        path = (deck.parent / ref).resolve()
        if not path.is_file():
            if RESULTS in path.parents:  # GPU results are committed after a GPU run: not there yet is fine
                print(f"slides: {deck.name}: {ref} is not committed yet (left as a link)")
                return None
            raise MissingImage(f"{deck.name}: image {ref!r} not found at {path}")
        mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()

    def attr(m):
        uri = data_uri(m.group(2))
        return m.group(0) if uri is None else f'{m.group(1)}"{uri}"'

    def css(m):
        uri = data_uri(m.group(2))
        return m.group(0) if uri is None else f'url("{uri}")'

    html = re.sub(r'(\bsrc=)"([^"]+)"', attr, html)
    return re.sub(r"""url\((&quot;|["']?)([^"')&]+)\1\)""", css, html)


def remote_urls(html: str) -> list[str]:
    """Every http(s) URL the page would fetch (XML namespaces and licence notices aside)."""
    html = LICENCE_NOTE.sub("", html)
    bad = [m.group(0) for m in FETCHED.finditer(html)]
    bad += [u for u in ANY_URL.findall(html) if not HARMLESS.match(u)]
    return sorted(set(bad))


def not_blank(png: Path) -> float:
    from PIL import Image, ImageStat

    with Image.open(png) as img:
        return ImageStat.Stat(img.convert("L")).stddev[0]


def main(argv) -> int:
    decks = [SLIDES / a for a in argv] if argv else sorted(SLIDES.glob("*.md"))
    decks = [d for d in decks if d.name.lower() != "readme.md"]
    if not decks:
        print("slides: no decks found")
        return 1
    env = dict(os.environ, CHROME_PATH=chrome_path())  # the tools first: a missing one is named, nothing built
    marp = marp_bin()
    BUILD.mkdir(exist_ok=True)
    for deck in decks:  # no stale output can pass the checks below
        for ext in ("html", "png"):
            (BUILD / f"{deck.stem}.{ext}").unlink(missing_ok=True)
    common = ["--config-file", CONFIG, "--no-stdin", "--browser", "chrome", "--browser-path", env["CHROME_PATH"],
              "--browser-timeout", "120"]
    failures = []
    # Every deck at once (Marp's input-dir mode) when building all; else one deck at a time.
    batches = [["--input-dir", SLIDES, "-o", BUILD]] if not argv else \
        [[deck, "-o", BUILD / f"{deck.stem}.{{ext}}"] for deck in decks]
    try:
        for batch in batches:
            fill = lambda ext: [str(a).replace("{ext}", ext) for a in batch]  # noqa: E731
            run([marp, *common, *fill("html")], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
            run([marp, *common, "--image", "png", *fill("png")], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    except subprocess.CalledProcessError as exc:
        print(f"slides: FAILED: marp exited with {exc.returncode}")
        return 1
    for deck in decks:
        html_path = BUILD / f"{deck.stem}.html"
        png_path = BUILD / f"{deck.stem}.png"
        if not (html_path.exists() and png_path.exists()):
            failures.append(f"{deck.name}: marp wrote no {html_path.name} or {png_path.name}")
            continue
        try:
            html = inline_local_images(html_path.read_text(), deck)
        except MissingImage as exc:
            failures.append(str(exc))
            continue
        html_path.write_text(html)
        urls = remote_urls(html)
        if urls:
            failures.append(f"{deck.name}: the HTML would fetch remote URLs: {urls[:5]}")
        spread = not_blank(png_path)
        if spread < 5.0:
            failures.append(f"{deck.name}: the first slide renders blank (pixel std {spread:.2f})")
        print(f"slides: {deck.name} -> {html_path.relative_to(REPO)} ({len(html) // 1024} KB), "
              f"{png_path.relative_to(REPO)} (pixel std {spread:.1f})", flush=True)
    if failures:
        print("slides: FAILED\n  " + "\n  ".join(failures))
        return 1
    print(f"slides: {len(decks)} deck(s) built, self-contained, first slides rendered and not blank")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
