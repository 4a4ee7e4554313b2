"""Test support shipped with deltastore: the store conformance class, emulators, fault proxy.

* :mod:`deltastore.testing.store_tests`: ``StoreConformance``, the tests every store backend
  must pass (subclass it once per backend).
* :mod:`deltastore.testing.servers`: moto S3 and fake-gcs-server on 127.0.0.1.
* :mod:`deltastore.testing.faults`: ``FaultProxy``, an HTTP proxy that injects errors, stalls
  and lost acknowledgements in front of a real server.

Importing this package imports nothing heavy; pytest is needed only by ``store_tests``.
"""
