# Only here for what pyproject.toml cannot say: the cffi core (cffi_modules) and the small
# CPython extension beside it (native/python/fastcall.c, which takes the core's functions'
# addresses from the cffi module at run time and links nothing of it).
from setuptools import Extension, setup

setup(
    cffi_modules=["native/build_native.py:ffibuilder"],
    ext_modules=[Extension("ringsync._fastcall", ["native/python/fastcall.c"],
                           include_dirs=["native/include"],
                           extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra",
                                               "-Wno-unused-parameter",
                                               "-Wno-missing-field-initializers"])],
)
