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


@pytest.fixture(autouse=True)
def _no_broken_calls_from_earlier_tests():
    """The client hooks remember broken stateless calls process-wide (a re-issue may come through another
    client): each test starts with none."""
    from mcp_stream_exporter.hooks._tracking import BROKEN_IN_PROCESS

    BROKEN_IN_PROCESS.clear()
