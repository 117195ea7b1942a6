"""What pyproject.toml cannot say: the top-level `kernels/` folder ships inside the package as
`atlas_cli.kernels` (a `package_dir` entry; `packages.find` only finds folders where their
names say). Everything else about the build is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

KERNELS = {"atlas_cli.kernels": "kernels", "atlas_cli.kernels.emu": "kernels/emu"}

setup(
    packages=[*find_namespace_packages(include=["atlas_cli*"], exclude=["*__pycache__"]), *KERNELS],
    package_dir=KERNELS,
)
