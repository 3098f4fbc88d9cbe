"""The daemon: its root nursery (``_server``), the model registry and the models' lifetimes, key
policy, logs and the operator's monitor. What it shares with the HTTP handlers and the session
store (configuration, the served-model record, metrics, the registry's interface) is in
:mod:`superfluid.serving`, below them."""
