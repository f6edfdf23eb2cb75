from llmpipe.cli import main

raise SystemExit(main())
