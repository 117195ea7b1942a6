from atlas_cli.entry import main

main()
