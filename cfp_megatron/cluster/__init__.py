"""Cluster model: hardware figures (``ClusterSpec``), what was measured on the live cluster, collective costs."""
