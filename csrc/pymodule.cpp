// Python module stub for the native optimizer library.
//
// The library is a plain C ABI (adamw.cpp) loaded with ctypes by megatrain_lightning/optim/native.py;
// it is built as a setuptools Extension only so that `pip install` compiles it with the interpreter's
// toolchain settings, names it with the interpreter's suffix and puts it inside the package (in place
// for `pip install -e .`). An extension module must export PyInit_<name>; this one returns an empty,
// importable module, so `import megatrain_lightning._adamw_native` works instead of failing oddly.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef mt_adamw_native_module = {
    PyModuleDef_HEAD_INIT,
    "megatrain_lightning._adamw_native",
    "Native fused CPU AdamW kernels (C ABI). Load with ctypes; see megatrain_lightning.optim.native.",
    -1,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__adamw_native(void) {
  return PyModule_Create(&mt_adamw_native_module);
}
