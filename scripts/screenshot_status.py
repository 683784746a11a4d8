"""Screenshots a lighthouse's status page with headless Chromium (PNG).

Usage:
  python scripts/screenshot_status.py URL [-o status.png]
      a live job's page, e.g. http://127.0.0.1:29511/
  python scripts/screenshot_status.py --demo [-o status.png]
      starts a lighthouse and two small replica groups in this process,
      trains a few steps, restarts one group (it heals), screenshots, stops.

Needs Debian's `chromium` (apt-get install -y chromium) or another Chromium
or Chrome on PATH, or CHROMIUM=/path/to/binary. The page loads nothing from
the network, so this works offline.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.chromium import CHROMIUM_ENV, screenshot  # noqa: E402


def demo(out: Path, width: int, height: int) -> None:
    from tools.demo_job import DemoJob  # imports torch: only for --demo

    job = DemoJob(num_groups=2)
    try:
        job.wait_steps(15)
        job.restart_group(1)
        job.wait_steps(30)
        screenshot(job.page_url(), out, width, height)
    finally:
        job.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False,  # a misspelled flag is an error, not a prefix match
        description=__doc__.split("\n\n")[0],
        epilog=f"environment: {CHROMIUM_ENV}  the Chromium binary (default: chromium on PATH)",
    )
    p.add_argument("url", nargs="?", help="the status page, e.g. http://127.0.0.1:29511/")
    p.add_argument("--demo", action="store_true", help="screenshot a small job started here")
    p.add_argument("-o", "--output", default="status.png", help="PNG to write (status.png)")
    p.add_argument("--size", default="1280x1600", help="window WIDTHxHEIGHT (1280x1600)")
    args = p.parse_args(argv)
    if bool(args.url) == args.demo:
        p.error("give either a URL or --demo")
    out = Path(args.output)
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        p.error(f"--size {args.size!r} is not WIDTHxHEIGHT, e.g. 1280x1600")
    try:
        demo(out, width, height) if args.demo else screenshot(args.url, out, width, height)
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"screenshot_status: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
