"""Developer tools: a real etcd and real agents on loopback, and the failure drills run on
them. Used by tests and benchmarks; nothing in the image imports them."""
