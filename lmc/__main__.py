from lmc.cli.main import main

# Guarded: engines that spawn processes (vLLM's engine core) import the main module again in them.
if __name__ == "__main__":
    raise SystemExit(main())
