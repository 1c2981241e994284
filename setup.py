"""Build hook for the optional native CPU optimizer (csrc/).

The extension is marked optional: when the system compiler or OpenMP is missing, the package still
installs and the optimizer runs on torch ops instead (megatrain_lightning.optim.native warns once).

csrc/adamw.cpp is a plain C ABI (no torch or Python headers) that megatrain_lightning/optim/native.py
loads with ctypes. It is declared as an ordinary setuptools Extension so that `pip install .` and
`pip install -e .` compile it with the interpreter's toolchain settings and put it inside the package
(in place, next to the sources, for an editable install); csrc/pymodule.cpp adds the PyInit_ symbol
every extension module must have. Only setuptools is needed at build time.

If the build with OpenMP fails (e.g. a clang without libomp), it is retried once without -fopenmp
(the kernel then runs on one thread); if that fails too, the extension is skipped with a warning.

The packages are listed here rather than in pyproject.toml (where a [tool.setuptools.packages] table would
override them): megatrain_lightning, ray_jobs (cluster nodes import it), and the YAML files of configs/,
shipped as package data under megatrain_lightning/configs so that an installed wheel has them
(`python -m ray_jobs.sweep --config configs/sweep/tiny-lr.yaml` finds them wherever it runs).
"""

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

_BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError)

OPENMP_FLAG = "-fopenmp"

native_adamw = Extension(
    "megatrain_lightning._adamw_native",
    sources=["csrc/adamw.cpp", "csrc/pymodule.cpp"],
    depends=["csrc/adamw_simd.inc"],
    language="c++",
    extra_compile_args=[
        "-std=c++17",
        "-O3",
        OPENMP_FLAG,
        # the kernel matches torch's rounding op by op: no silent a*b+c -> fma contraction
        "-ffp-contract=off",
        "-fvisibility=hidden",
    ],
    extra_link_args=[OPENMP_FLAG],  # with GCC: links libgomp
    optional=True,
)


class BuildExtOpenMPFallback(build_ext):
    """build_ext that retries an extension once without OpenMP before giving up on it."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except _BUILD_ERRORS as err:
            if OPENMP_FLAG not in ext.extra_compile_args:
                raise
            self.warn(
                f"building {ext.name} with OpenMP failed ({err}); retrying without OpenMP (single-threaded kernel)"
            )
            ext.extra_compile_args = [a for a in ext.extra_compile_args if a != OPENMP_FLAG]
            ext.extra_link_args = [a for a in ext.extra_link_args if a != OPENMP_FLAG]
            super().build_extension(ext)


# configs/ (a directory of YAML files, no Python) installed as package data of megatrain_lightning.configs
CONFIG_PACKAGES = {
    "megatrain_lightning.configs": "configs",
    "megatrain_lightning.configs.sweep": "configs/sweep",
    "megatrain_lightning.configs.run": "configs/run",
}

setup(
    packages=find_namespace_packages(include=["megatrain_lightning*", "ray_jobs*"]) + list(CONFIG_PACKAGES),
    package_dir=CONFIG_PACKAGES,
    package_data={name: ["*.yaml"] for name in CONFIG_PACKAGES},
    ext_modules=[native_adamw],
    cmdclass={"build_ext": BuildExtOpenMPFallback},
)
