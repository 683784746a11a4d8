"""The lighthouse stays light: importing it never imports torch."""

import subprocess
import sys


def test_importing_lighthouse_does_not_import_torch():
    modules = "lighthouse, lighthouse.cli, lighthouse.status.server"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
