"""`python -m jaxformer ...`: the `jaxformer` command."""
from jaxformer.cli import main

main.run()
