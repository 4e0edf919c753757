"""Flower apps: the ServerApp aggregates shared tensors, the ClientApp runs a
method's local procedure and keeps private state on the device."""
