from lmc.cli.main import main

raise SystemExit(main())
