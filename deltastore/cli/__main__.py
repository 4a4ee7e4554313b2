from deltastore.cli import main

raise SystemExit(main())
