"""`python -m mooncake` is the `mooncake` command."""

from mooncake.cli import main

main()
