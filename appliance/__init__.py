"""Appliance side of dgpp: model store, deployment handling and the `dgpp` command line."""
