# Only here for cffi_modules: everything else about the package is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
