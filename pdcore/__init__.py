"""The bottom layer: plain helpers and types that several packages share.

Imports nothing of the project and no third-party service client (no grpc, redis, torch), so
the engine, kvtransfer, the services and the gateway can all import it without importing each
other (the one-way layers tests/unit/test_architecture.py checks).
"""
