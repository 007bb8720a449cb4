import pytest


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def redis_server():
    """A real redis-server of the test's own; skipped, and said so, only when it is not installed."""
    from redis_server import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.close()
