"""Puts torchft_like_as_torchft.pth (the TORCHFT_LIKE_AS_TORCHFT start-up
hook) into site-packages, for wheels and for editable installs alike; the
rest of the metadata is in pyproject.toml."""

from __future__ import annotations

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "torchft_like_as_torchft.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class EditableWheel(editable_wheel):
    # An editable wheel holds only links to the source tree; its root (what
    # lands in site-packages) is filled here, beside setuptools' own .pth.
    def _install_namespaces(self, installation_dir: str, pth_prefix: str) -> None:
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(os.path.join(HERE, PTH), os.path.join(installation_dir, PTH))


setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
