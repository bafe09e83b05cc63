"""Work spread over 4 devices. JAX fixes its devices when it starts, so these tests run in
a process of their own, a step of `.ci/run`:
`XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m pytest -n auto tests/multidevice`.
A run with fewer devices leaves this directory out (tests/conftest.py)."""
