"""The daemon: its root nursery (``_server``), the model registry and supervisors, the served-model
record, configuration, key policy, metrics and the CPU policy of its event-loop thread."""
