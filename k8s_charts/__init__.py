"""cdk8s charts for the platform's Kubernetes objects (etcd, Volcano, storage, jobs)."""
