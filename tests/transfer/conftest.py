"""Services shared by the transfer tests."""

from mooncake.transfer.contract import BlockService


class KeepingService(BlockService):
    """A service that holds blocks as it gets them, as the decode inbox does (a held key is a no-op): its
    transport must hand it bytes that stay valid after the transport's own buffers are reused."""
    keeps_blocks = True

    def __init__(self):
        self.blocks = {}

    def put_block(self, key, data, checksum=None):
        self.blocks.setdefault(key, data)

    def get_block(self, key):
        return self.blocks.get(key)
