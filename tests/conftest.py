"""Every test process sees 8 fake CPU devices, so sharded layouts can be
compared with the single-device result in one process."""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
