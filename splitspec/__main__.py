from splitspec.cli import main

raise SystemExit(main())
