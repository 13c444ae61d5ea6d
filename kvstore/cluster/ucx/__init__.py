"""The process's UCX runtime and the network devices it may use."""
