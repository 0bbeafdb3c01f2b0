"""Which packages the wheel holds: every package found under the four source roots, so a new one is never missed.

`kernels/`, `storage/` and `migrations/` ship as `kvtierd.kernels`, `kvtierd.storage` and `kvtierd.migrations`
(setuptools' package-dir). pyproject.toml holds everything else; this is only the discovery it cannot express
over renamed roots.
"""

from setuptools import find_packages, setup

ROOTS = {"kvtierd": "kvtierd", "kvtierd.kernels": "kernels", "kvtierd.storage": "storage",
         "kvtierd.migrations": "migrations"}

setup(
    package_dir=ROOTS,
    packages=sorted({name for root, folder in ROOTS.items()
                     for name in (root, *(f"{root}.{sub}" for sub in find_packages(folder)))}),
)
