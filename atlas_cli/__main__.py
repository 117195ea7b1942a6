from atlas_cli.cli import main

main()
