"""Native parts (csrc/): the store IO engine and Blend's paged attention kernel; everything else is in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "ucm.store._native",
        sorted(["csrc/store_io.cpp"]),
        include_dirs=["csrc/third_party"],  # xxhash/xxhash.h, vendored (BSD-2-Clause)
        cxx_std=17,
        extra_compile_args=["-O3", "-pthread"],
        extra_link_args=["-pthread"],
    ),
    Pybind11Extension(
        "ucm.sparse.blend._attention",
        ["csrc/paged_attention.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3", "-pthread"],
        extra_link_args=["-pthread"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
