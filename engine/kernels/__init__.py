"""Ferry's C++ CPU kernels: their one build (`build.py`) and the linear kernels (`linear.py`, `cpu_linear.cpp`)."""
